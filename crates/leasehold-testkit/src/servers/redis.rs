//! redis-server: single servers, Redlock sets, a replicated pair.

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
