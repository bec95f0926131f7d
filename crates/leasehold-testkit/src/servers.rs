//! Real lock servers for tests: redis-server, etcd, ZooKeeper and PostgreSQL from Debian's
//! packages, each on free loopback ports with a temporary directory, ready when it really
//! serves, and killed (by pid) when its handle drops.
//!
//! Every handle can pause (SIGSTOP) and resume (SIGCONT) its process, kill it, and restart
//! it on the same ports. `./scripts/test` installs the packages.

use std::ffi::OsString;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tempfile::TempDir;

use crate::probe::{Resp, http_get, redis_command, redis_commands, zookeeper_word};
use crate::process::{ServerProcess, find_program, free_port, wait_ready};

/// How long a server may take to become ready.
const READY_LIMIT: Duration = Duration::from_secs(60);
/// How often a start-up is retried with fresh ports (another process took a port).
const START_ATTEMPTS: usize = 3;

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))
}

fn os(args: &[String]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

async fn with_retries<T>(mut attempt: impl AsyncFnMut() -> io::Result<T>) -> io::Result<T> {
    let mut last = None;
    for _ in 0..START_ATTEMPTS {
        match attempt().await {
            Ok(server) => return Ok(server),
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Err(error),
            Err(error) => last = Some(error),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("no start-up attempt")))
}

// ---------------------------------------------------------------------------------------
// Redis

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
}

/// Whether a TLS server asks its clients for a certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// Clients may connect without one.
    Optional,
    /// Clients without a certificate signed by the test CA are refused.
    Required,
}

/// The files of a test certificate authority, written by `openssl` into a server's
/// directory: the CA, the server's certificate (for 127.0.0.1 and localhost) and a client
/// certificate, each with its key.
fn write_test_certificates(dir: &Path) -> io::Result<()> {
    let openssl = find_program("openssl", &[])?;
    let run = |args: &[&str]| -> io::Result<()> {
        let out = std::process::Command::new(&openssl)
            .args(args)
            .current_dir(dir)
            .output()?;
        if out.status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "openssl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    run(&[
        &["req", "-x509", "-nodes", "-days", "2"],
        &ec[..],
        &[
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-subj",
            "/CN=leasehold test CA",
        ],
    ]
    .concat())?;
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )?;
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n")?;
    for (who, cn) in [("server", "localhost"), ("client", "leasehold test client")] {
        let subject = format!("/CN={cn}");
        run(&[
            &["req", "-nodes"],
            &ec[..],
            &[
                "-keyout",
                &format!("{who}.key"),
                "-out",
                &format!("{who}.csr"),
            ],
            &["-subj", &subject],
        ]
        .concat())?;
        run(&[
            "x509",
            "-req",
            "-days",
            "2",
            "-in",
            &format!("{who}.csr"),
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &format!("{who}.crt"),
            "-extfile",
            &format!("{who}.ext"),
        ])?;
    }
    Ok(())
}

impl RedisBuilder {
    /// Adds `--name value` to the command line (e.g. `maxmemory-policy`, `appendonly`).
    pub fn config(mut self, name: &str, value: &str) -> Self {
        self.config.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Also serves TLS on a second port, with a certificate of a test CA generated for this
    /// server (see [`Redis::tls_url`]); the plain port stays for administration.
    pub fn tls(mut self, clients: ClientAuth) -> Self {
        self.tls = Some(clients);
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
                    write_test_certificates(dir.path())?;
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
        wait_ready(&mut self.process, READY_LIMIT, async || {
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

    /// `rediss://127.0.0.1:tls-port?tls_ca=…` for a server built with
    /// [`RedisBuilder::tls`]: the TLS port, trusting the test CA.
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

    /// Kills the server if it runs and starts it again on the same port. Without
    /// persistence it comes back empty.
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
        let mut replica = Redis::builder()
            .config("replicaof", &format!("127.0.0.1 {}", primary.port()))
            .start()
            .await?;
        let addr = replica.addr();
        wait_ready(&mut replica.process, READY_LIMIT, async || {
            redis_command(addr, &["INFO", "replication"])
                .await
                .ok()
                .and_then(|r| r.text())
                .is_some_and(|info| info.contains("master_link_status:up"))
        })
        .await?;
        Ok(Self { primary, replica })
    }
}

// ---------------------------------------------------------------------------------------
// etcd

/// An etcd cluster of one or more members on loopback, with short heartbeat and election
/// timeouts. Health and metrics are served on a plain-HTTP port of their own, so that a
/// member serving its clients over TLS is probed alike.
#[derive(Debug)]
pub struct Etcd {
    members: Vec<EtcdMember>,
    tls: bool,
    dir: TempDir,
}

/// One etcd member.
#[derive(Debug)]
pub struct EtcdMember {
    process: ServerProcess,
    name: String,
    client_port: u16,
    metrics_port: u16,
}

impl Etcd {
    /// A single-member cluster.
    ///
    /// # Errors
    ///
    /// If etcd is not installed or does not become healthy.
    pub async fn start() -> io::Result<Etcd> {
        Self::cluster(1).await
    }

    /// A cluster of `n` members.
    ///
    /// # Errors
    ///
    /// If etcd is not installed or the cluster does not become healthy.
    pub async fn cluster(n: usize) -> io::Result<Etcd> {
        Self::launch(n, None).await
    }

    /// A single member that serves its clients over TLS only, with a certificate of a test
    /// CA generated for it (see [`Etcd::tls_url`]).
    ///
    /// # Errors
    ///
    /// If etcd or openssl is not installed or the member does not become healthy.
    pub async fn tls(clients: ClientAuth) -> io::Result<Etcd> {
        Self::launch(1, Some(clients)).await
    }

    async fn launch(n: usize, tls: Option<ClientAuth>) -> io::Result<Etcd> {
        let program = find_program("etcd", &[])?;
        with_retries(async || {
            let dir = tempfile::tempdir()?;
            let client_scheme = if tls.is_some() { "https" } else { "http" };
            let mut tls_args = Vec::new();
            if let Some(clients) = tls {
                write_test_certificates(dir.path())?;
                let file = |name: &str| dir.path().join(name).display().to_string();
                tls_args = vec![
                    format!("--cert-file={}", file("server.crt")),
                    format!("--key-file={}", file("server.key")),
                ];
                // etcd 3.4 asks every client for a certificate once it has a CA to check
                // them against.
                if clients == ClientAuth::Required {
                    tls_args.push(format!("--trusted-ca-file={}", file("ca.crt")));
                    tls_args.push("--client-cert-auth".into());
                }
            }
            let ports: Vec<(u16, u16, u16)> = (0..n)
                .map(|_| (free_port(), free_port(), free_port()))
                .collect();
            let initial_cluster = ports
                .iter()
                .enumerate()
                .map(|(i, (_, peer, _))| format!("m{i}=http://127.0.0.1:{peer}"))
                .collect::<Vec<_>>()
                .join(",");
            let mut members = Vec::with_capacity(n);
            for (i, (client, peer, metrics)) in ports.iter().enumerate() {
                let name = format!("m{i}");
                let mut args = vec![
                    format!("--name={name}"),
                    format!("--data-dir={}", dir.path().join(&name).display()),
                    format!("--listen-client-urls={client_scheme}://127.0.0.1:{client}"),
                    format!("--advertise-client-urls={client_scheme}://127.0.0.1:{client}"),
                    format!("--listen-metrics-urls=http://127.0.0.1:{metrics}"),
                    format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
                    format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
                    format!("--initial-cluster={initial_cluster}"),
                    "--initial-cluster-state=new".into(),
                    "--initial-cluster-token=leasehold-test".into(),
                    "--heartbeat-interval=20".into(),
                    "--election-timeout=200".into(),
                    "--logger=zap".into(),
                    "--log-level=warn".into(),
                ];
                args.extend(tls_args.iter().cloned());
                let process = ServerProcess::start(
                    &format!("etcd member {name}"),
                    &program,
                    os(&args),
                    dir.path().join(format!("{name}.log")),
                )?;
                members.push(EtcdMember {
                    process,
                    name,
                    client_port: *client,
                    metrics_port: *metrics,
                });
            }
            let mut etcd = Etcd {
                members,
                tls: tls.is_some(),
                dir,
            };
            for member in &mut etcd.members {
                member.wait_ready().await?;
            }
            Ok(etcd)
        })
        .await
    }

    /// Client endpoints, `127.0.0.1:port` each.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect()
    }

    /// `etcd://127.0.0.1:p1,127.0.0.1:p2,...`.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.endpoints().join(","))
    }

    /// `etcds://127.0.0.1:p?tls_ca=…` for a member started with [`Etcd::tls`]: its
    /// endpoints, trusting the test CA.
    pub fn tls_url(&self) -> Option<String> {
        let ca = self.tls_file("ca.crt")?;
        Some(format!(
            "etcds://{}?tls_ca={}",
            self.endpoints().join(","),
            ca.display()
        ))
    }

    /// A file of the test CA of a TLS member: `ca.crt`, `client.crt`, `client.key`, ….
    pub fn tls_file(&self, name: &str) -> Option<PathBuf> {
        self.tls.then(|| self.dir.path().join(name))
    }

    /// The members.
    pub fn members(&mut self) -> &mut [EtcdMember] {
        &mut self.members
    }

    /// The index of the member that currently leads, as the members report it.
    pub async fn leader(&self) -> Option<usize> {
        for (i, member) in self.members.iter().enumerate() {
            let Ok(metrics) = http_get(member.metrics_addr(), "/metrics").await else {
                continue;
            };
            if metrics
                .lines()
                .any(|l| l.starts_with("etcd_server_is_leader ") && l.ends_with(" 1"))
            {
                return Some(i);
            }
        }
        None
    }
}

impl EtcdMember {
    async fn wait_ready(&mut self) -> io::Result<()> {
        let addr = self.metrics_addr();
        wait_ready(&mut self.process, READY_LIMIT, async || {
            http_get(addr, "/health")
                .await
                .is_ok_and(|body| body.contains("\"health\":\"true\""))
        })
        .await
    }

    /// The member's name (`m0`, `m1`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its client address.
    pub fn addr(&self) -> SocketAddr {
        loopback(self.client_port)
    }

    /// Its plain-HTTP address for `/health` and `/metrics`.
    pub fn metrics_addr(&self) -> SocketAddr {
        loopback(self.metrics_port)
    }

    /// The process (pause, resume, kill, log).
    pub fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// Kills the member if it runs and starts it again with its data; waits until it is
    /// healthy (which needs a quorum of the cluster up).
    ///
    /// # Errors
    ///
    /// If it does not become healthy.
    pub async fn restart(&mut self) -> io::Result<()> {
        self.process.restart()?;
        self.wait_ready().await
    }
}

// ---------------------------------------------------------------------------------------
// ZooKeeper

const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";

/// A ZooKeeper server or ensemble on loopback, with a 200 ms tick.
#[derive(Debug)]
pub struct ZooKeeper {
    servers: Vec<ZooKeeperServer>,
    _dir: TempDir,
}

/// One ZooKeeper server.
#[derive(Debug)]
pub struct ZooKeeperServer {
    process: ServerProcess,
    client_port: u16,
}

impl ZooKeeper {
    /// A standalone server.
    ///
    /// # Errors
    ///
    /// If ZooKeeper (or Java) is not installed or it does not start serving.
    pub async fn start() -> io::Result<ZooKeeper> {
        Self::ensemble(1).await
    }

    /// An ensemble of `n` servers (`n == 1`: standalone), returned once its election has
    /// settled: one leader, the others following it.
    ///
    /// # Errors
    ///
    /// As for [`start`](ZooKeeper::start).
    pub async fn ensemble(n: usize) -> io::Result<ZooKeeper> {
        let java = find_program("java", &[])?;
        if !Path::new(ZOOKEEPER_JAR).is_file() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "zookeeper is not installed; ./scripts/test installs every server the tests need",
            ));
        }
        with_retries(async || {
            let dir = tempfile::tempdir()?;
            let ports: Vec<[u16; 3]> = (0..n)
                .map(|_| [free_port(), free_port(), free_port()])
                .collect();
            let mut servers = Vec::with_capacity(n);
            for (i, [client, ..]) in ports.iter().enumerate() {
                let id = i + 1;
                let data = dir.path().join(format!("zk{id}"));
                std::fs::create_dir_all(&data)?;
                std::fs::write(data.join("myid"), format!("{id}\n"))?;
                let mut config = format!(
                    "tickTime=200\ninitLimit=20\nsyncLimit=10\ndataDir={}\nclientPort={client}\n\
                     clientPortAddress=127.0.0.1\nadmin.enableServer=false\n\
                     4lw.commands.whitelist=srvr,stat,ruok,mntr,cons\nmaxSessionTimeout=60000\n",
                    data.display()
                );
                if n > 1 {
                    for (j, [_, q, e]) in ports.iter().enumerate() {
                        config.push_str(&format!("server.{}=127.0.0.1:{q}:{e}\n", j + 1));
                    }
                }
                let config_file = data.join("zoo.cfg");
                std::fs::write(&config_file, config)?;
                let args = vec![
                    "-Xmx256m".to_owned(),
                    "-XX:+UseSerialGC".into(),
                    "-XX:TieredStopAtLevel=1".into(),
                    format!("-Dzookeeper.log.dir={}", data.display()),
                    "-cp".into(),
                    ZOOKEEPER_JAR.into(),
                    "org.apache.zookeeper.server.quorum.QuorumPeerMain".into(),
                    config_file.display().to_string(),
                ];
                let process = ServerProcess::start(
                    &format!("zookeeper {id}"),
                    &java,
                    os(&args),
                    data.join("zookeeper.log"),
                )?;
                servers.push(ZooKeeperServer {
                    process,
                    client_port: *client,
                });
            }
            let mut zookeeper = ZooKeeper { servers, _dir: dir };
            for server in &mut zookeeper.servers {
                server.wait_ready().await?;
            }
            if n > 1 {
                // Every server having a mode is not enough: while an election settles, two
                // can say "leader" for a moment. Ready is one leader and n - 1 followers.
                let addrs: Vec<SocketAddr> = zookeeper.servers.iter().map(|s| s.addr()).collect();
                wait_ready(&mut zookeeper.servers[0].process, READY_LIMIT, async || {
                    let mut leaders = 0;
                    for addr in &addrs {
                        match zookeeper_mode(*addr).await.as_deref() {
                            Some("leader") => leaders += 1,
                            Some("follower") => {}
                            _ => return false,
                        }
                    }
                    leaders == 1
                })
                .await?;
            }
            Ok(zookeeper)
        })
        .await
    }

    /// `127.0.0.1:p1,127.0.0.1:p2,...`, as ZooKeeper clients take it.
    pub fn connect_string(&self) -> String {
        self.servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `zookeeper://127.0.0.1:p1,...`.
    pub fn url(&self) -> String {
        format!("zookeeper://{}", self.connect_string())
    }

    /// The servers.
    pub fn servers(&mut self) -> &mut [ZooKeeperServer] {
        &mut self.servers
    }
}

/// The mode the ZooKeeper server at `addr` reports (`srvr`), if it answers.
async fn zookeeper_mode(addr: SocketAddr) -> Option<String> {
    let answer = zookeeper_word(addr, "srvr").await.ok()?;
    answer
        .lines()
        .find_map(|l| l.strip_prefix("Mode: "))
        .map(str::to_owned)
}

impl ZooKeeperServer {
    async fn wait_ready(&mut self) -> io::Result<()> {
        let addr = self.addr();
        wait_ready(&mut self.process, READY_LIMIT, async || {
            zookeeper_word(addr, "srvr")
                .await
                .is_ok_and(|answer| answer.contains("Mode: "))
        })
        .await
    }

    /// Its client address.
    pub fn addr(&self) -> SocketAddr {
        loopback(self.client_port)
    }

    /// `standalone`, `leader` or `follower`, as the server reports it.
    pub async fn mode(&self) -> Option<String> {
        zookeeper_mode(self.addr()).await
    }

    /// The process (pause, resume, kill, log).
    pub fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// Kills the server if it runs and starts it again with its data.
    ///
    /// # Errors
    ///
    /// If it does not start serving (an ensemble member needs a quorum).
    pub async fn restart(&mut self) -> io::Result<()> {
        self.process.restart()?;
        self.wait_ready().await
    }
}

// ---------------------------------------------------------------------------------------
// PostgreSQL

/// A PostgreSQL server on a free loopback port (`trust` authentication, user `postgres`),
/// running as the `postgres` user when the tests run as root. `fsync` is off: committed
/// data survives killing the server, not the machine.
#[derive(Debug)]
pub struct Postgres {
    process: ServerProcess,
    port: u16,
    bin: PathBuf,
    _dir: TempDir,
}

impl Postgres {
    /// Starts a server from a data directory copied from a template made once per machine
    /// (`initdb` is the slow part).
    ///
    /// # Errors
    ///
    /// If PostgreSQL is not installed or does not accept connections.
    pub async fn start() -> io::Result<Postgres> {
        let bin = postgres_bin()?;
        let user = postgres_user()?;
        let template = tokio::task::spawn_blocking({
            let bin = bin.clone();
            move || postgres_template(&bin, user)
        })
        .await
        .map_err(io::Error::other)??;
        with_retries(async || {
            let dir = tempfile::tempdir()?;
            let data = dir.path().join("data");
            let copied = std::process::Command::new("cp")
                .arg("-a")
                .arg(&template)
                .arg(&data)
                .status()?;
            if !copied.success() {
                return Err(io::Error::other("copying the PostgreSQL template failed"));
            }
            if let Some((uid, gid)) = user {
                chown(dir.path(), uid, gid)?;
                chown(&data, uid, gid)?;
            }
            let port = free_port();
            let args = vec![
                "-D".to_owned(),
                data.display().to_string(),
                "-p".into(),
                port.to_string(),
                "-k".into(),
                dir.path().display().to_string(),
                "-c".into(),
                "listen_addresses=127.0.0.1".into(),
                "-c".into(),
                "fsync=off".into(),
                "-c".into(),
                "full_page_writes=off".into(),
                "-c".into(),
                "shared_buffers=16MB".into(),
            ];
            let process = ServerProcess::start_as(
                "postgres",
                &bin.join("postgres"),
                os(&args),
                Vec::new(),
                user,
                dir.path().join("postgres.log"),
            )?;
            let mut postgres = Postgres {
                process,
                port,
                bin: bin.clone(),
                _dir: dir,
            };
            postgres.wait_ready().await?;
            Ok(postgres)
        })
        .await
    }

    async fn wait_ready(&mut self) -> io::Result<()> {
        let isready = self.bin.join("pg_isready");
        let port = self.port.to_string();
        wait_ready(&mut self.process, READY_LIMIT, async || {
            tokio::process::Command::new(&isready)
                .args(["-q", "-h", "127.0.0.1", "-U", "postgres", "-p", &port])
                .status()
                .await
                .is_ok_and(|s| s.success())
        })
        .await
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:port/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The process (pause, resume, kill, log).
    pub fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// Kills the server (as `pg_ctl stop -m immediate` would) and starts it again with its
    /// data.
    ///
    /// # Errors
    ///
    /// If it does not accept connections again.
    pub async fn restart(&mut self) -> io::Result<()> {
        self.process.restart()?;
        self.wait_ready().await
    }
}

fn postgres_bin() -> io::Result<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "PostgreSQL is not installed under /usr/lib/postgresql",
        )
    })
}

/// `(uid, gid)` of the `postgres` user when running as root (PostgreSQL refuses root);
/// `None` when not root.
fn postgres_user() -> io::Result<Option<(u32, u32)>> {
    if !rustix::process::getuid().is_root() {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    passwd
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            (fields.first() == Some(&"postgres") && fields.len() > 3)
                .then(|| Some((fields[2].parse().ok()?, fields[3].parse().ok()?)))
                .flatten()
        })
        .map(Some)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "running as root, but there is no postgres user to run PostgreSQL as",
            )
        })
}

fn chown(path: &Path, uid: u32, gid: u32) -> io::Result<()> {
    rustix::fs::chown(
        path,
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(gid)),
    )
    .map_err(io::Error::from)
}

/// The initdb'd template data directory, made once per machine under an exclusive file
/// lock so that concurrent test processes do not race.
fn postgres_template(bin: &Path, user: Option<(u32, u32)>) -> io::Result<PathBuf> {
    let version = bin
        .parent()
        .and_then(Path::file_name)
        .and_then(|v| v.to_str())
        .unwrap_or("pg");
    let root = std::env::temp_dir().join(format!("leasehold-testkit-postgres-{version}"));
    let template = root.join("data");
    std::fs::create_dir_all(&root)?;
    let lock = std::fs::File::create(root.join("lock"))?;
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)?;
    if root.join("ready").is_file() {
        return Ok(template);
    }
    let _ = std::fs::remove_dir_all(&template);
    std::fs::create_dir_all(&template)?;
    if let Some((uid, gid)) = user {
        chown(&template, uid, gid)?;
    }
    let mut initdb = std::process::Command::new(bin.join("initdb"));
    initdb
        .args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
            "-D",
        ])
        .arg(&template)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    if let Some((uid, gid)) = user {
        use std::os::unix::process::CommandExt;
        initdb.uid(uid).gid(gid).current_dir("/");
    }
    let out = initdb.output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    std::fs::write(root.join("ready"), b"")?;
    Ok(template)
}
