//! etcd: single members and clusters, plain or TLS.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tempfile::TempDir;

use super::{ClientAuth, READY_LIMIT, loopback, os, with_retries, write_test_certificates};
use crate::probe::http_get;
use crate::process::{ServerProcess, find_program, free_port, wait_ready};

/// The election timeout of test members (their heartbeat is a tenth of it).
const ELECTION_TIMEOUT: Duration = Duration::from_millis(200);

/// An etcd cluster of one or more members on loopback, with short heartbeat and election timeouts.
/// Health and metrics are served on a plain-HTTP port of their own, so that a member
/// serving its clients over TLS is probed alike.
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
        Self::launch(n, None, ELECTION_TIMEOUT).await
    }

    /// A cluster of `n` members whose election timeout is `election`.
    /// Their heartbeat is a tenth of it.
    ///
    /// # Errors
    ///
    /// If etcd is not installed or the cluster does not become healthy.
    pub async fn cluster_with_election_timeout(n: usize, election: Duration) -> io::Result<Etcd> {
        Self::launch(n, None, election).await
    }

    /// A single member whose election timeout is `election` (its heartbeat a tenth of it).
    ///
    /// # Errors
    ///
    /// If etcd is not installed or the member does not become healthy.
    pub async fn start_with_election_timeout(election: Duration) -> io::Result<Etcd> {
        Self::launch(1, None, election).await
    }

    /// A single member that serves its clients over TLS only.
    /// It has a certificate of a test CA generated for it (see [`Etcd::tls_url`]).
    ///
    /// # Errors
    ///
    /// If etcd or openssl is not installed or the member does not become healthy.
    pub async fn tls(clients: ClientAuth) -> io::Result<Etcd> {
        Self::launch(1, Some(clients), ELECTION_TIMEOUT).await
    }

    async fn launch(n: usize, tls: Option<ClientAuth>, election: Duration) -> io::Result<Etcd> {
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
                    format!("--heartbeat-interval={}", (election / 10).as_millis()),
                    format!("--election-timeout={}", election.as_millis()),
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

    /// Runs `etcdctl` (Debian package etcd-client) on this plain-text cluster.
    /// It gets `args`, `input` on its standard input, and answers with what it printed:
    /// an independent client, for looking at keys and writing them directly.
    ///
    /// # Errors
    ///
    /// If etcdctl cannot run or fails (its standard error is in the message).
    pub async fn etcdctl(&self, args: &[&str], input: &str) -> io::Result<String> {
        use tokio::io::AsyncWriteExt;
        let mut child = tokio::process::Command::new("etcdctl")
            .arg(format!("--endpoints={}", self.endpoints().join(",")))
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(input.as_bytes()).await?;
        }
        let out = child.wait_with_output().await?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "etcdctl {}: {}: {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        String::from_utf8(out.stdout).map_err(io::Error::other)
    }

    /// `etcd://127.0.0.1:p1,127.0.0.1:p2,...`.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.endpoints().join(","))
    }

    /// `etcds://127.0.0.1:p?tls_ca=…` for a member started with [`Etcd::tls`].
    /// Its endpoints, trusting the test CA.
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
        wait_ready(&mut self.process, addr.port(), READY_LIMIT, async || {
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

    /// Kills the member if it runs and starts it again with its data.
    /// It waits until it is healthy (which needs a quorum of the cluster up).
    ///
    /// # Errors
    ///
    /// If it does not become healthy.
    pub async fn restart(&mut self) -> io::Result<()> {
        self.process.restart()?;
        self.wait_ready().await
    }
}
