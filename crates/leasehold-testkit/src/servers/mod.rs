//! Real lock servers for tests: redis-server, etcd, ZooKeeper and PostgreSQL.
//! Redis alone, replicated, under Sentinel, or as a Cluster.
//! They come from Debian's packages, each on free loopback ports with a temporary
//! directory, ready when it really serves, and killed (by pid) when its handle drops.
//!
//! Every handle can pause (SIGSTOP) and resume (SIGCONT) its process, kill it, and restart
//! it on the same ports. `./scripts/test` installs the packages.

use std::ffi::OsString;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::Path;
use std::time::Duration;

use crate::process::find_program;

mod etcd;
mod postgres;
mod redis;
mod redis_cluster;
mod zookeeper;

pub use etcd::{Etcd, EtcdMember};
pub use postgres::{PgBouncer, PoolMode, Postgres, PostgresBuilder, libfaketime};
pub use redis::{
    Redis, RedisBuilder, RedisReplicated, RedisSentinel, SENTINEL_MASTER, redis_servers,
};
pub use redis_cluster::RedisCluster;
pub use zookeeper::{Curator, ZooKeeper, ZooKeeperServer};

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

/// Whether a TLS server asks its clients for a certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// Clients may connect without one.
    Optional,
    /// Clients without a certificate signed by the test CA are refused.
    Required,
}

/// The files of a test certificate authority, written by `openssl` into a server's directory.
/// The CA, the server's certificate (for 127.0.0.1 and localhost) and a client certificate,
/// each with its key.
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
